"""spekula on Ray Serve: an HTTP ingress over engine replicas, routed by prompt prefix."""
