"""A stand-in ``trtexec``: parses the build options compress writes and builds through the stand-in TensorRT.

It proves the command line compress produces is complete and consistent (shapes, typing, flags),
not TensorRT. Usage mirrors trtexec: ``--onnx= --saveEngine= --minShapes= --optShapes= --maxShapes=``
and ``--stronglyTyped``/``--fp16``/``--int8``/``--int4``/``--versionCompatible``. The device's
compute capability and the TensorRT version come from ``STANDIN_SM`` and ``STANDIN_TRT``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.standins.trt_standin import StandInCuda, make_tensorrt  # noqa: E402


def _shapes(spec: str) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for item in spec.split(","):
        name, dims = item.rsplit(":", 1)
        shapes[name] = tuple(int(d) for d in dims.split("x"))
    return shapes


def main(argv: list[str]) -> int:
    options = dict(arg[2:].split("=", 1) if "=" in arg else (arg[2:], "") for arg in argv)
    version = os.environ.get("STANDIN_TRT", "10.3.0")
    trt = make_tensorrt(StandInCuda(sm=int(os.environ.get("STANDIN_SM", "87"))), version)
    print(f"[I] TensorRT version: {version}")
    builder = trt.Builder(trt.Logger())
    strongly = "stronglyTyped" in options
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly else 0)
    trt.OnnxParser(network, None).parse_from_file(options["onnx"])
    config = builder.create_builder_config()
    for flag, name in (
        ("fp16", "FP16"),
        ("int8", "INT8"),
        ("int4", "INT4"),
        ("versionCompatible", "VERSION_COMPATIBLE"),
        ("sparsity", "SPARSE_WEIGHTS"),
    ):
        if flag in options:
            config.set_flag(getattr(trt.BuilderFlag, name))
    low, opt, high = (_shapes(options[f"{kind}Shapes"]) for kind in ("min", "opt", "max"))
    profile = builder.create_optimization_profile()
    for name in low:
        profile.set_shape(name, low[name], opt[name], high[name])
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        print(f"[E] {trt.log[-1]}")
        print("&&&& FAILED TensorRT.trtexec")
        return 1
    Path(options["saveEngine"]).write_bytes(engine)
    print("&&&& PASSED TensorRT.trtexec")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
