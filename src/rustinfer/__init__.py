"""The rustinfer meta package: the `rustinfer serve` launcher."""
