"""Small servers the adapters' tasks and tests run: ``mcp_calc`` (an MCP stdio server,
``rollart.env.adapters.mcp``) and ``openenv_calc`` (an OpenEnv environment and its HTTP
server, ``rollart.env.adapters.openenv``). Each also runs as a script (``python <file>``)
from this folder, where no module shadows the ``mcp`` or ``openenv`` packages."""
