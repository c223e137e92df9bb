"""Run metrics: metrics.jsonl (always), the summary, and the progress display."""
