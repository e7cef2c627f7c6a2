"""The lab: the simulator and the in-process demo. No serving process imports this package
(tests/contracts/test_boundaries.py fails if one does)."""
