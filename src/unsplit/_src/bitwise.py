"""Bitwise mode (issue 3): placeholder until the canonical reduction lands."""


class BitwiseStep:
    def __init__(self, step):
        raise NotImplementedError(
            "bitwise=True arrives with issue 3 (many hosts and bitwise mode); "
            "use bitwise=False for now."
        )
