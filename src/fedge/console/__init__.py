"""The operator console (issue 14): the fleet in a browser, served over the manager's store.

Modules, one per concept: ``accounts`` (operator tokens and roles), ``audit`` (who did
what, when), ``sessions`` (cookies and CSRF tokens), ``views`` (what the pages show, read
through the Fleet library), ``actions`` (what operators change, through the same library
calls as the CLI), ``app`` (routes and live updates), ``server`` (uvicorn).

Errors::

    fedge.errors.FedgeError
      └── ConsoleError          the console cannot start or a token command failed
            └── BadInput        a form field is malformed or tampered with (HTTP 400)
"""
