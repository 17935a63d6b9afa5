#!/bin/sh
# As the official nats image's entrypoint: a command that starts with a flag is nats-server's arguments.
case "$1" in
  -*) set -- nats-server "$@" ;;
esac
exec "$@"
