"""What a run reports: metrics rows and trackers, the console, tokens/s and MFU, memory measured beside the plan."""
