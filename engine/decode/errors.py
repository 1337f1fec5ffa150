"""The one error the decode engine raises for bad input."""


class DecodeError(ValueError):
    """A request the decode engine cannot serve: raised for that request alone, nothing else is disturbed."""
