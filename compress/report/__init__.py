"""``report.json`` (versioned schema) and the human report."""

from compress.report.build import REPORT_SCHEMA_VERSION, build_report, write_reports

__all__ = ["REPORT_SCHEMA_VERSION", "build_report", "write_reports"]
