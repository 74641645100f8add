"""The floor everything stands on: errors, atomic file writes, tables, the optional-dependency gate, the environment
record and the version. Imports nothing of the project above it, and neither torch nor timm (checked by a test)."""
