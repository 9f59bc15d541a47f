"""Options every client command shares, and help that shows their defaults.

``geonear knn``, ``load``, ``loadtest`` and the other client commands all reach a server
the same way: ``--target``, ``--token`` and the TLS flags, each defaulting to an
environment variable so that a shell session configures them once:

==========================  ===================  =====================================
variable                    flag                 meaning
==========================  ===================  =====================================
``GEONEAR_TARGET``          ``--target``         server ``host:port`` (localhost:50051)
``GEONEAR_TOKEN``           ``--token``          bearer token
``GEONEAR_TLS``             ``--tls``            1/true/yes: TLS with the system's CAs
``GEONEAR_TLS_CA``          ``--tls-ca``         CA bundle that signed the server
``GEONEAR_TLS_CLIENT_CERT`` ``--tls-cert``       client certificate, for mutual TLS
``GEONEAR_TLS_CLIENT_KEY``  ``--tls-key``        client key, for mutual TLS
``GEONEAR_TLS_SERVER_NAME`` ``--tls-server-name``  name to verify in the server's certificate
==========================  ===================  =====================================

The client certificate's variables say CLIENT because ``GEONEAR_TLS_CERT`` and
``GEONEAR_TLS_KEY`` are the server's own (``geonear serve`` reads them).

This module is public, unlike the rest of ``geonear.clients``: the load test
(``geonear.loadtest``), which uses only public APIs, and any other tool that should reach
a server as the ``geonear`` commands do take their flags and variables from here.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

DEFAULT_TARGET = "localhost:50051"
TARGET_VARIABLE = "GEONEAR_TARGET"
TOKEN_VARIABLE = "GEONEAR_TOKEN"
#: Flag destination -> environment variable.
TLS_VARIABLES = {
    "tls_ca": "GEONEAR_TLS_CA",
    "tls_cert": "GEONEAR_TLS_CLIENT_CERT",
    "tls_key": "GEONEAR_TLS_CLIENT_KEY",
    "tls_server_name": "GEONEAR_TLS_SERVER_NAME",
}
TLS_VARIABLE = "GEONEAR_TLS"
_TRUE = ("1", "true", "yes", "on")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default in its help, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        nothing = action.default is None or action.default is False or action.default == ""
        if nothing or action.help is None:
            return action.help
        return super()._get_help_string(action)


def default_target() -> str:
    """GEONEAR_TARGET, else localhost:50051."""
    return os.environ.get(TARGET_VARIABLE) or DEFAULT_TARGET


def add_connection_arguments(
    parser: argparse.ArgumentParser | Any, *, target: bool = True, title: str | None = None
) -> None:
    """``--target`` (when ``target``), ``--token`` and the TLS flags on ``parser``.

    Secrets are not defaults here (help would print them): :func:`connection_options`
    reads the environment after parsing.
    """
    group = parser.add_argument_group(title) if title else parser
    if target:
        group.add_argument(
            "--target",
            metavar="HOST:PORT",
            default=default_target(),
            help=f"server address; {TARGET_VARIABLE} sets the default (default: %(default)s)",
        )
    group.add_argument(
        "--token",
        default=None,
        help=f"bearer token (default: the {TOKEN_VARIABLE} environment variable)",
    )
    group.add_argument(
        "--tls",
        action="store_true",
        default=None,
        help=f"use TLS, trusting the system's CAs (default: {TLS_VARIABLE}=1 turns it on)",
    )
    group.add_argument(
        "--tls-ca",
        metavar="PEM",
        help="CA bundle that signed the server's certificate "
        f"(default: ${TLS_VARIABLES['tls_ca']})",
    )
    group.add_argument(
        "--tls-cert",
        metavar="PEM",
        help=f"client certificate, for mutual TLS (default: ${TLS_VARIABLES['tls_cert']})",
    )
    group.add_argument(
        "--tls-key",
        metavar="PEM",
        help=f"client private key, for mutual TLS (default: ${TLS_VARIABLES['tls_key']})",
    )
    group.add_argument(
        "--tls-server-name",
        help="name to verify in the server's certificate "
        f"(default: ${TLS_VARIABLES['tls_server_name']})",
    )


@dataclass(frozen=True)
class ConnectionOptions:
    """Where and how to connect, flags first, then the environment."""

    target: str
    token: str | None
    tls: bool
    tls_ca: str | None
    tls_cert: str | None
    tls_key: str | None
    tls_server_name: str | None

    def client_keywords(self) -> dict[str, Any]:
        """Keywords of :class:`geonear.Client` (all but the target)."""
        return {
            "token": self.token,
            "tls": self.tls,
            "tls_ca": self.tls_ca,
            "tls_cert": self.tls_cert,
            "tls_key": self.tls_key,
            "server_name": self.tls_server_name,
        }


def connection_options(args: argparse.Namespace) -> ConnectionOptions:
    """The options of parsed ``args``, each missing flag filled from its variable."""
    env = os.environ
    tls_files = {
        dest: getattr(args, dest, None) or env.get(variable) or None
        for dest, variable in TLS_VARIABLES.items()
    }
    tls_flag = getattr(args, "tls", None)
    tls = bool(tls_flag) or env.get(TLS_VARIABLE, "").strip().lower() in _TRUE
    return ConnectionOptions(
        target=getattr(args, "target", None) or default_target(),
        token=getattr(args, "token", None) or env.get(TOKEN_VARIABLE) or None,
        tls=tls,
        **tls_files,
    )
