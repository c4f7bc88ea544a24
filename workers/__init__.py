"""Ray tasks that wrap pipeline stages: fetch inputs, run the stage, store outputs, report usage."""
