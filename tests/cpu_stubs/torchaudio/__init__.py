"""Empty stand-in for torchaudio (CPU environment only; see tests/cpu_stubs/README.md)."""

__version__ = "0.0.0+harvest.cpu.stub"
