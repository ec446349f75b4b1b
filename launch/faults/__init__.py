"""Keeping a long run alive: bad-step and loss-spike guards, preemption (guard), the step-progress watchdog."""
