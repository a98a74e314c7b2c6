"""What a run reports: console and train.log, meters, sinks, summary.json, environment."""
