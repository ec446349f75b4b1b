"""What a run reports: model FLOPs (flops), metric records and writers (records), and the dashboard."""
