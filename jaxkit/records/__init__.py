"""What a run writes down: metrics, step records and the summary, W&B, reports and
figures, and memory probes.

May import: plan and everything below it.
"""
