"""Consoles: a capsule's serial console and screen, on this host and through the agent to the page.

Owns the guest's serial console — its log, markers waited for, an interactive session on its pty
(``serial.py``) —, its screen — QEMU's VNC socket and screenshots (``screen.py``) —, the agent's console
tickets and WebSockets (``routes.py``) and the relay of a peer's consoles through this agent
(``relay.py``).

Layering: a slice through the layers, so each module sits at its own level and this ``__init__`` imports
nothing. ``serial.py`` is at the runtime's level (``capsule.runtime.accel`` and ``capsule.lifecycle``
wait on the serial log) and imports only ``capsule.errors`` and ``capsule.runtime``; ``screen.py`` sits
above the store and the lifecycle (``capsule.lifecycle.memimage`` names the VNC socket); ``routes.py`` and
``relay.py`` are the agent's (they import ``capsule.agent.sessions``, ``capsule.hosts`` and the agent
client) and are installed by ``capsule.agent.dashboard``. Nothing below the agent imports them.
"""
