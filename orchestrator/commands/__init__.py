"""One module per command family; cli.py registers what each exports in COMMANDS."""
