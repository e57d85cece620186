"""What both worker roles share: the messages they exchange with the router, the step loop
that runs a role engine on its own thread, and the process shell that Ray places."""
