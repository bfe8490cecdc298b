"""The public step and train step: options, the ``Step`` object, the optimizer update's driver."""
