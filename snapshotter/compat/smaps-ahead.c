/*
 * Part 14 of the shim (criu-shim.c): the dumped processes' smaps read ahead, on a thread of
 * its own, while CRIU's main thread dumps the processes before them.
 *
 * CRIU reads /proc/<pid>/smaps of every process it dumps, for the VmFlags only that file has,
 * and the kernel answers by walking the process's page tables to count its Rss and Pss: 3.7-5
 * ms for a python holding 256 MiB here, while the sandbox is frozen, on one core while the
 * other mostly waits. The tree is frozen before CRIU's main starts (part 8's "g"), so from then
 * on every process's smaps reads the same until CRIU itself changes the process (its parasite
 * maps a blob into it), which CRIU does only after it has read that process's smaps. So once
 * Grove says "g", a thread reads the smaps of every process of the tree but its root (which
 * CRIU reads at once), in the tree's order, into memory; when CRIU opens a process's smaps, the
 * open returns a memfd holding what the thread read (waiting for it if the thread is reading
 * it just then). A process the thread has not begun when CRIU asks is CRIU's to read, as
 * always; so is anything the thread failed to read. Each copy is handed out once.
 *
 * The thread starts inside a constructor, before the shim's other wrappers resolve their next
 * symbols: it makes its system calls directly. It ends once it has read the tree; CRIU entering
 * another mount or user namespace (which the kernel allows a single-threaded process only)
 * waits for that first (smaps_ahead_stop).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "smaps-ahead.h"

/* Processes read ahead at most; a sandbox's tree beyond that is read by CRIU as before. */
#define AHEAD_MAX 256

enum ahead_state { AHEAD_WAITING, AHEAD_READING, AHEAD_READY, AHEAD_TAKEN };

struct ahead {
	pid_t pid;
	enum ahead_state state;
	char *buf;
	size_t len;
};

static struct ahead aheads[AHEAD_MAX];
static int nr_aheads;
/* The process whose thread reads ahead (a process forked from it takes nothing). */
static pid_t owner;
static int running;
static pthread_t thread;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;

static int sys_open(const char *path)
{
	return (int)syscall(SYS_openat, AT_FDCWD, path, O_RDONLY | O_CLOEXEC, 0);
}

/* The whole of `path`, NUL-terminated, or NULL (then *len is 0). */
static char *read_all(const char *path, size_t *len)
{
	*len = 0;
	int fd = sys_open(path);
	if (fd < 0)
		return NULL;
	size_t cap = 64 << 10, n = 0;
	char *buf = malloc(cap);
	for (;;) {
		if (!buf)
			break;
		if (n + 1 >= cap) {
			char *more = realloc(buf, cap * 2);
			if (!more) {
				free(buf);
				buf = NULL;
				break;
			}
			buf = more;
			cap *= 2;
		}
		long r = syscall(SYS_read, fd, buf + n, cap - n - 1);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0) {
			free(buf);
			buf = NULL;
			break;
		}
		if (r == 0)
			break;
		n += (size_t)r;
	}
	syscall(SYS_close, fd);
	if (buf) {
		buf[n] = '\0';
		*len = n;
	}
	return buf;
}

/* The pid after -t / --tree in CRIU's command line; 0 if there is none. */
static pid_t tree_root(void)
{
	size_t len;
	char *cmd = read_all("/proc/self/cmdline", &len);
	pid_t root = 0;
	for (size_t at = 0; cmd && at < len;) {
		const char *arg = cmd + at;
		size_t n = strnlen(arg, len - at);
		at += n + 1;
		if ((strcmp(arg, "-t") == 0 || strcmp(arg, "--tree") == 0) && at < len) {
			root = (pid_t)atoi(cmd + at);
			break;
		}
	}
	free(cmd);
	return root > 0 ? root : 0;
}

static void add(pid_t pid)
{
	for (int i = 0; i < nr_aheads; i++)
		if (aheads[i].pid == pid)
			return;
	if (nr_aheads < AHEAD_MAX)
		aheads[nr_aheads++] = (struct ahead){.pid = pid, .state = AHEAD_WAITING};
}

/* Adds the children of every thread of `pid` (the file lists a thread's children). */
static void add_children(pid_t pid)
{
	char path[64];
	snprintf(path, sizeof(path), "/proc/%d/task", (int)pid);
	int dir = (int)syscall(SYS_openat, AT_FDCWD, path, O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
	if (dir < 0)
		return;
	char ents[4096];
	long n;
	while ((n = syscall(SYS_getdents64, dir, ents, sizeof(ents))) > 0) {
		for (long at = 0; at < n;) {
			/* struct linux_dirent64: ino, off, reclen, type, name */
			unsigned short reclen;
			memcpy(&reclen, ents + at + 16, sizeof(reclen));
			const char *name = ents + at + 19;
			at += reclen;
			if (name[0] < '0' || name[0] > '9')
				continue;
			snprintf(path, sizeof(path), "/proc/%d/task/%s/children", (int)pid, name);
			size_t len;
			char *kids = read_all(path, &len);
			for (char *p = kids; p && p < kids + len;) {
				char *end;
				long kid = strtol(p, &end, 10);
				if (end == p)
					break;
				if (kid > 0)
					add((pid_t)kid);
				p = end;
			}
			free(kids);
		}
	}
	syscall(SYS_close, dir);
}

static void *read_ahead(void *unused)
{
	(void)unused;
	pid_t root = tree_root();
	if (!root)
		return NULL;
	/* The tree, breadth first (CRIU dumps it root first, then down). Only this thread adds to
	 * the list, and only here; a pid, once added, never changes. */
	pthread_mutex_lock(&lock);
	add_children(root);
	for (int i = 0; i < nr_aheads; i++)
		add_children(aheads[i].pid);
	pthread_mutex_unlock(&lock);
	for (int i = 0; i < nr_aheads; i++) {
		pthread_mutex_lock(&lock);
		if (aheads[i].state != AHEAD_WAITING) {
			pthread_mutex_unlock(&lock);
			continue;
		}
		aheads[i].state = AHEAD_READING;
		pthread_mutex_unlock(&lock);
		char path[64];
		snprintf(path, sizeof(path), "/proc/%d/smaps", (int)aheads[i].pid);
		size_t len;
		char *buf = read_all(path, &len);
		pthread_mutex_lock(&lock);
		aheads[i].len = len;
		/* Nothing read (the process is gone): CRIU's to read, whatever it finds. */
		if (buf && !len) {
			free(buf);
			buf = NULL;
		}
		aheads[i].buf = buf;
		aheads[i].state = buf ? AHEAD_READY : AHEAD_TAKEN;
		pthread_cond_broadcast(&changed);
		pthread_mutex_unlock(&lock);
	}
	return NULL;
}

void smaps_ahead_start(void)
{
	const char *v = getenv("GROVE_READ_AHEAD_SMAPS");
	if (!v || strcmp(v, "1") != 0)
		return;
	if (pthread_create(&thread, NULL, read_ahead, NULL) == 0) {
		owner = getpid();
		running = 1;
	}
}

int smaps_ahead_stop(void)
{
	if (!running || owner != getpid())
		return 0;
	pthread_join(thread, NULL);
	running = 0;
	return 1;
}

/* The pid in "/proc/<pid>/smaps"; 0 for any other path. */
static pid_t smaps_pid(const char *path)
{
	int pid, end = 0;
	if (sscanf(path, "/proc/%d/smaps%n", &pid, &end) != 1 || end == 0 || path[end] != '\0')
		return 0;
	return pid > 0 ? (pid_t)pid : 0;
}

int smaps_ahead_take(int fd)
{
	if (!owner || owner != getpid())
		return fd;
	char link[64], path[64];
	snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
	ssize_t n = readlink(link, path, sizeof(path) - 1);
	if (n <= 0)
		return fd;
	path[n] = '\0';
	pid_t pid = smaps_pid(path);
	if (!pid)
		return fd;
	char *buf = NULL;
	size_t len = 0;
	pthread_mutex_lock(&lock);
	for (int i = 0; i < nr_aheads; i++) {
		if (aheads[i].pid != pid)
			continue;
		while (aheads[i].state == AHEAD_READING)
			pthread_cond_wait(&changed, &lock);
		if (aheads[i].state == AHEAD_READY) {
			buf = aheads[i].buf;
			len = aheads[i].len;
			aheads[i].buf = NULL;
		}
		aheads[i].state = AHEAD_TAKEN;
		break;
	}
	pthread_mutex_unlock(&lock);
	if (!buf)
		return fd;
	int copy = memfd_create("grove-smaps", MFD_CLOEXEC);
	size_t done = 0;
	while (copy >= 0 && done < len) {
		ssize_t w = write(copy, buf + done, len - done);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0) {
			close(copy);
			copy = -1;
		} else {
			done += (size_t)w;
		}
	}
	free(buf);
	if (copy < 0 || lseek(copy, 0, SEEK_SET) != 0) {
		if (copy >= 0)
			close(copy);
		return fd;
	}
	/* The copy takes the number CRIU was given. */
	if (dup3(copy, fd, O_CLOEXEC) < 0) {
		close(copy);
		return fd;
	}
	close(copy);
	return fd;
}
