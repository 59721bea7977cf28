"""``report.json`` (versioned schema) and the human reports, built from the run directory."""
