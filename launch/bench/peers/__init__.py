"""The MoE-layer peers of `moe-bench layer`: scripts that other interpreters run (only torch and the peer library).

fwdbwd.py is the one forward+backward timing loop, shared by our rows and the peer scripts; it imports torch
only, so a peer's interpreter runs it as a sibling module. setup.sh makes the peers' virtual environments.
"""
