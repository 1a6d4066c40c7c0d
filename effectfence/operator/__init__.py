"""The operator's side: see what is fenced, clear it with a recorded reason, audit what ran.

A room around the core (the core never imports it): ``effectfence intents`` (list, show,
clear, watch), ``effectfence certs`` (export and verify a domain's certificates, from a
store or a file) and ``effectfence console`` (a small web page doing the same). They work
against any store URL, by default the one the servers use, so an operator reconciles what
the agents' servers fenced without handing the clear power to an agent.

The rule "a live lease is cleared only when forced" is the core's
(:data:`effectfence.protocol.CLEAR_TABLE`, applied by :meth:`EffectFence.clear`); nothing
here decides it. Nothing here shows an intent's args or result unless asked
(``--show-payload``): they may hold personal data.
"""

from __future__ import annotations

__all__: list[str] = []
