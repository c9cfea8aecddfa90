"""Placeholder for the real DFlash trainer, which lives in the user's own repository.

jobs/dflash-qwen3.6-27b.yaml uploads this file; replace it with your trainer (same name) before
`dfo launch`. It refuses to run so a forgotten swap cannot burn GPU hours.
"""
import sys

sys.exit("train_dflash_online.py here is a placeholder: put the real trainer next to the job file")
