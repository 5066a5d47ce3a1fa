"""FLUX.2 ([dev], [klein]) on the same engine: configs, inputs, checkpoint layout conversion."""
