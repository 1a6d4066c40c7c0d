"""``effectfence wrap``: put any stdio MCP server behind the fence, with no code from the user.

A room of its own: the core never imports it. :mod:`~effectfence.wrap.proxy` is the relay,
:mod:`~effectfence.wrap.policy` the TOML policy, :mod:`~effectfence.wrap.probe` the
double-fire detector, :mod:`~effectfence.wrap.demo` the bundled double-firing server.
"""
