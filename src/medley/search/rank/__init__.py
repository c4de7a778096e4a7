"""The finalists simulated exactly and ranked (:mod:`.ranking`), improved locally
(:mod:`.polish`), the reason when none fits (:mod:`.shortfall`), and the named baselines ranked
beside them (:mod:`.baselines`: metis-style and others, each as its practitioners would run it)."""
