"""The `spekula` and `spekula-server` command lines: one module per subcommand and the shared options."""
