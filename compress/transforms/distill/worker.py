"""One distillation rank under ``torchrun`` (DDP, or FSDP for models that do not fit one device).

    torchrun --standalone --nproc_per_node=N -m compress.transforms.distill.worker --job JOB.json

The job file (written by the distill stage) names the student and teacher folders, the token
windows, the training config and where checkpoints and the trained student go.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from compress.core.errors import StageError
from compress.models.families import decoder_blocks
from compress.models.loading import load_causal_lm
from compress.transforms.distill.config import DistillConfig
from compress.transforms.distill.train import Distiller, Ranks, read_job, write_job

log = logging.getLogger(__name__)


def _wrap(config: DistillConfig):
    def wrap(model):
        if config.distributed == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for block in decoder_blocks(model):
                fully_shard(block)
            fully_shard(model)
            return model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(
            model, device_ids=[torch.cuda.current_device()] if torch.cuda.is_available() else None
        )

    return wrap


def run_job(job: dict) -> None:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    config = DistillConfig.model_validate(job["config"])
    torch.manual_seed(config.seed)
    student = load_causal_lm(Path(job["student"]))
    teacher = load_causal_lm(Path(job["teacher"])) if config.loss == "kd" else None
    windows = torch.load(job["windows"], weights_only=True)
    ranks = Ranks(rank, world, _wrap(config) if world > 1 else None)
    distiller = Distiller(student, teacher, windows, config, Path(job["checkpoints"]), job.get("kept_layers"), ranks)
    history = distiller.run(progress=rank == 0)
    if rank == 0:
        out = Path(job["out"])
        student.save_pretrained(out)
        (out / "history.json").write_text(json.dumps(history))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


@dataclass(frozen=True)
class JobFolders:
    """Where a distributed job keeps its checkpoints, writes the trained student, and keeps its job file and data."""

    checkpoints: Path
    out: Path
    work: Path


def train_distributed(student_dir: Path, teacher_dir: Path, windows: torch.Tensor, config: DistillConfig,
                      kept_layers: list[int], folders: JobFolders) -> list[dict[str, float]]:
    """Train under ``torchrun`` with ``config.processes`` ranks (this worker module, one job file); returns the
    history."""
    checkpoints, out, work = folders.checkpoints, folders.out, folders.work
    torch.save(windows, work / "windows.pt")
    job = work / "job.json"
    write_job(job, {"student": str(student_dir), "teacher": str(teacher_dir), "windows": str(work / "windows.pt"),
                    "config": config.model_dump(mode="json"), "checkpoints": str(checkpoints), "out": str(out),
                    "kept_layers": kept_layers})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={config.processes}",
               "-m", "compress.transforms.distill.worker", "--job", str(job)]
    log.info("launching: %s", " ".join(command))
    if subprocess.run(command, check=False).returncode != 0:
        raise StageError(f"distributed distillation failed ({' '.join(command)})")
    return json.loads((out / "history.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", required=True, type=Path)
    run_job(read_job(parser.parse_args().job))


if __name__ == "__main__":
    main()
