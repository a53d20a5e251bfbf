"""Study tools on top of the bit-exact emulator: dumps, synthetic and SmolLM2 problems, the accuracy
studies and the ``apa`` command. They import the core (``apa_emu.api``, ``apa_emu.config``, ...);
no core module imports them, so ``apa_emu/*.py`` stays exactly what docs/numerics.md specifies."""
