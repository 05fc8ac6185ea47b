"""conformance: checks every fast op against its refgdn twin (``python -m conformance``)."""
