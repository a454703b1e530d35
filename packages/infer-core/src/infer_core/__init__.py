"""Pure-Python domain: dtypes, plan value types and the ports."""
