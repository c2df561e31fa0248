"""The serve layer: what a long-running service built on the transport needs, knowing
nothing of MoE. The worker daemon and the gateway both run on it.

- :mod:`.loop`: :class:`ServeLoop`, one thread and one poller over listeners, handshakes in
  progress, served connections, other pollables, timers and a wake pipe; connection caps,
  idle timeouts, bounded per-connection outboxes, accept back-off, graceful drain;
- :mod:`.wake`: the wake pipe (signal handlers and threads wake the loop through it);
- :mod:`.launch`: start a service as a child process and learn its URL; stop it for sure;
- :mod:`.metrics`: Prometheus plumbing shared by the services' exporters;
- :mod:`.secrets`: the shared secret's file: read it, or make one only its user can read;
- :mod:`.options`: command-line pieces every service shares.
"""
