"""MAML: an inner differentiable optimizer per task, an outer optimizer for the shared initialisation."""
