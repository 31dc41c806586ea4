"""A small MCP server over stdio: a calculator, for ``rollart.env.adapters.mcp``'s task
and tests.

Run as a script (``python <this file>``; ``rollart.env.adapters.mcp.CALC_SERVER`` is its
path), so starting it does not import rollart. Built with the ``mcp`` SDK's ``MCPServer`` (``FastMCP`` before
mcp 2). Tools:

* ``calculate(expression)``: the value of an integer expression of ``+ - * // % ( )``
  (parsed with ``ast``, never ``eval``); a bad expression is a tool error the model reads;
* ``add(a, b)`` and ``multiply(a, b)`` on integers.
"""

from __future__ import annotations

import ast
import operator

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}

server = MCPServer("rollart-calc", log_level="WARNING")


def evaluate(expression: str) -> int:
    """The value of an integer ``+ - * // %`` expression; ``ValueError`` otherwise.

    >>> evaluate("7 * (8 - 2)")
    42
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        if abs(left) > 10**12 or abs(right) > 10**12:
            raise ValueError("numbers too large")
        return _OPS[type(node.op)](left, right)
    raise ValueError("only integers and + - * // % ( ) are allowed")


@server.tool()
def calculate(expression: str) -> str:
    """Evaluate an integer arithmetic expression, e.g. '7 * 8'."""
    try:
        return str(evaluate(expression))
    except ValueError as e:
        raise ToolError(str(e)) from None


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


if __name__ == "__main__":
    server.run("stdio")
