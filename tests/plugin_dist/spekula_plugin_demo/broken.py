"""A plugin whose import fails: spekula must report it as a clear ConfigError, not a traceback."""

raise ImportError("spekula_plugin_demo.broken needs a dependency that is not installed")
