"""What a run shows: metrics, trackers, figures, plots, samples, the dashboard."""
