"""spekula: a speculative-decoding inference engine.

The repository root is the ``spekula`` package (see ``[tool.setuptools.package-dir]`` in
pyproject.toml); its folders are the subpackages ``spekula.core``, ``spekula.backends``,
``spekula.drafters``, ``spekula.frontends`` and ``spekula.fixtures``.
"""

__version__ = "0.1.0"
