"""The routing decision, below HTTP: which replica serves a request, and where its session lives."""

from router.routing.directory import PeerSessions, SessionDirectory, SiblingSessions
from router.routing.lending import lend_worth
from router.routing.route import AGAIN_PAUSE_S, MOVE_SLACK_MS, Observer, Route, Routing, Served, Verdict

__all__ = [
    "AGAIN_PAUSE_S",
    "MOVE_SLACK_MS",
    "Observer",
    "PeerSessions",
    "Route",
    "Routing",
    "Served",
    "SessionDirectory",
    "SiblingSessions",
    "Verdict",
    "lend_worth",
]
