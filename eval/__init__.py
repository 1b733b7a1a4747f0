"""specdec.eval: the losslessness certificate and the acceptance / speed suite."""
