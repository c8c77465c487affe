"""How long a test waits for a subprocess: long enough that only a hang reaches it, whatever the machine's load
(a timeout is for hangs, not for slowness)."""

HANG_S = 1800
