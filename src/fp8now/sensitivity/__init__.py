"""Data-free sensitivity (issue 40, part 2): `sensitivity()` scores every quantizable layer by how much its FP8
version moves the output distribution (score.py), select.py chooses the layers `Fp8Config(keep_bf16="auto:F")`
keeps in bf16, and keep.py is fp8now.load's hook for that option."""
