"""The fleet's Flower SuperLink: the process on loopback (``link``), the front stations
reach (``front``), the app signatures it hands out (``signed_apps``), and where a client
on this host reaches it (``address``)."""
