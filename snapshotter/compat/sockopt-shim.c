/*
 * Preloaded into CRIU 4.1 on kernels >= 6.16, which restrict SO_PASSCRED/SO_PASSSEC to
 * AF_UNIX/AF_NETLINK sockets and answer EOPNOTSUPP elsewhere (checkpoint-restore/criu#2705).
 * CRIU 4.1 treats that as a fatal dump error for every TCP/UDP socket; these options are
 * meaningless on such sockets, so report them as off, and accept "off" when restoring.
 * Newer CRIU releases do the same internally.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <string.h>
#include <sys/socket.h>

#ifndef SO_PASSSEC
#define SO_PASSSEC 34
#endif

static int is_pass_opt(int level, int name)
{
	return level == SOL_SOCKET && (name == SO_PASSCRED || name == SO_PASSSEC);
}

int getsockopt(int fd, int level, int name, void *val, socklen_t *len)
{
	static int (*real)(int, int, int, void *, socklen_t *);
	if (!real)
		real = (int (*)(int, int, int, void *, socklen_t *))dlsym(RTLD_NEXT, "getsockopt");
	int r = real(fd, level, name, val, len);
	if (r < 0 && errno == EOPNOTSUPP && is_pass_opt(level, name) && val && len &&
	    *len >= sizeof(int)) {
		memset(val, 0, sizeof(int));
		*len = sizeof(int);
		errno = 0;
		return 0;
	}
	return r;
}

int setsockopt(int fd, int level, int name, const void *val, socklen_t len)
{
	static int (*real)(int, int, int, const void *, socklen_t);
	if (!real)
		real = (int (*)(int, int, int, const void *, socklen_t))dlsym(RTLD_NEXT, "setsockopt");
	int r = real(fd, level, name, val, len);
	if (r < 0 && errno == EOPNOTSUPP && is_pass_opt(level, name) && val &&
	    len >= sizeof(int) && *(const int *)val == 0) {
		errno = 0;
		return 0;
	}
	return r;
}
