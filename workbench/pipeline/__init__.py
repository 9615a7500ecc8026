"""The transform pipeline: framework (interface, config, stepper) and transforms."""
