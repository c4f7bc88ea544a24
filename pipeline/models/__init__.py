"""Models as the stages use them: HF loading, the elastic model (training, serving), LM scoring, precision."""
