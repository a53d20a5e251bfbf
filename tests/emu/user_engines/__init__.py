"""Engines written as a user of apa_emu would write them, outside apa_emu/ and apa_gpu/: the public
engine interface (docs/engines.md) is all they use."""
