"""Running the model without training it: the trace of the example batch, the fake process group
and fake tensors, simulated steps, kernel workspace."""
