"""Self-distillation of a draft head from its base model (`flowedge draft-head train`)."""
