"""Pure build stages over files and tensors: importance, reordering, packaging. No Ray, DB or HTTP."""
