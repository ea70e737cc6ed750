/*
 * Preloaded into CRIU 4.1; two fixes, each a no-op where CRIU does not hit its bug.
 *
 * 1. Socket options. Kernels >= 6.16 restrict SO_PASSCRED/SO_PASSSEC to AF_UNIX/AF_NETLINK
 *    sockets and answer EOPNOTSUPP elsewhere (checkpoint-restore/criu#2705). CRIU 4.1 treats
 *    that as a fatal dump error for every TCP/UDP socket; these options are meaningless on such
 *    sockets, so report them as off, and accept "off" when restoring. Newer CRIU releases do
 *    the same internally.
 *
 * 2. setns into the mount namespace the caller is already in. To restore a unix socket bound to
 *    a path, CRIU switches the restoring task into the socket's mount namespace. When the tree
 *    has a dead session leader (any `cmd &` left behind by a shell that exited), CRIU forks a
 *    helper task for that session with CLONE_FS from the root task, and the kernel refuses a
 *    mount-namespace setns from a task whose fs_struct is shared (EINVAL). The root task (Grove's
 *    init, whose control socket is bound in /run/grove) is then already in the namespace it asks
 *    for, so the switch is a no-op: answer success when, and only when, the target namespace is
 *    the caller's own.
 *
 * And, in a second build of this file (GROVE_SHIM_UFFD_WP defined, criu-shim-uffd.so) that Grove
 * preloads only into dumps of sandboxes it tracks with userfaultfd write-protect, with
 * GROVE_UFFD_WP=1 (snapshotter/src/dirty, docs/incremental-snapshots.md). It wraps read(2),
 * which the plain build must not: with the wrappers merely present, passing every call through,
 * about one dump in three of a small frozen tree here timed out seizing it (CRIU saw a task stay
 * in the freezer, state D); without them, none did.
 *
 * 4. Soft-dirty from userfaultfd. This kernel has no soft-dirty bits, so CRIU would refuse
 *    --track-mem. Grove registers every process of the sandbox for async write-protect and
 *    write-protects all their pages right after each dump, while the sandbox is still frozen;
 *    a page written since then reads PAGE_IS_WRITTEN in PAGEMAP_SCAN. CRIU reads memory with
 *    PAGEMAP_SCAN asking for PAGE_IS_SOFT_DIRTY: that request is answered with
 *    "written, or outside a registered VMA" in its place (PAGE_IS_WRITTEN, PAGE_IS_WPALLOWED),
 *    so a page is taken from the parent images only when Grove protected it right after the
 *    parent's dump and nothing wrote it since.
 *    Reads of a pagemap file (the fallback path and CRIU's probe of its own pages) report
 *    every page soft-dirty: the probe passes and the fallback dumps everything. CRIU's
 *    clear_refs write stays the kernel's no-op; Grove re-protects after the dump. The feature
 *    cache goes to a file of its own (".uffd-wp" appended), so runs with and without this
 *    never share a cached answer.
 *
 * 7. Page writes coalesced (GROVE_COALESCE_PAGE_WRITES=1, tracked dumps). CRIU writes the pages
 *    it dumps with one splice(2) from a pipe into the pages image per pagemap entry. An
 *    incremental dump's pages are scattered (each dirtied page its own entry), so a 256 MiB heap
 *    with 5 % written costs 3,300 splices, about 4.5 us each into ext4 here, frozen. CRIU fills
 *    each pipe with one buffer's pages, in address order, before it writes any of them, and
 *    writes all of them, in that order, to one pages image. So the first splice from a pipe
 *    into a pages image moves everything the pipe holds, and the splices CRIU then makes from
 *    that pipe are answered from the bytes already moved, without a syscall. The image is byte
 *    for byte what CRIU would have written. Should CRIU ever ask otherwise (another pipe or
 *    file while moved bytes are unclaimed, or that pipe closed with bytes unclaimed), the
 *    image no longer matches its pagemap: that splice, and every later one into the image,
 *    fails with EIO, and so does the dump; Grove then dumps in full.
 *
 * 9. No TCP socket, answered without the walk (GROVE_EMPTY_TCP_DIAG=1, tracked dumps). CRIU
 *    collects the namespace's sockets with sock_diag dumps, and the kernel answers a TCP dump
 *    by walking the host's whole established table, every namespace's buckets: 1.6 ms per
 *    address family here, while the sandbox is frozen. Where the namespace holds no hashed TCP
 *    socket (its own sockstat and sockstat6 say `inuse 0`: no listener, no connection in any
 *    state; a socket never bound or connected is in no table and CRIU dumps it without the
 *    diag), and it has no TIME_WAIT entry (`tw 0`), the kernel's answer would be empty. So a TCP
 *    dump request sent on a sock_diag socket of such a namespace is not sent, and the next read
 *    of that socket is one NLMSG_DONE with the request's sequence number. The namespace is the
 *    socket's (CRIU makes the socket inside the dumped namespace and sends from its own), whose
 *    counts the thread reads from inside it. Other families and protocols, and namespaces with a
 *    TCP socket, go to the kernel as before.
 *
 * And speed-ups in both builds, each active only when Grove asks for it:
 *
 * 3. CRIU's kernel-feature cache. CRIU probes the kernel on every run (about 30 ms here) unless
 *    it finds /run/criu.kdat, which it writes only where /run is a tmpfs (the cache must not
 *    outlive a reboot). On hosts whose /run is not one, GROVE_CRIU_KDAT names a file on a tmpfs
 *    and CRIU's open/rename/unlink of /run/criu.kdat and /run/criu.kdat.tmp go there instead.
 *
 * 5. An empty conntrack table, answered without the walk (GROVE_EMPTY_CONNTRACK=1). CRIU dumps
 *    the conntrack table of every network namespace it dumps, even one it only names as
 *    external, and sends that dump request twice (its expectations request carries the
 *    conntrack subsystem's GET). The kernel answers by walking the host's whole table, all
 *    network namespaces' buckets (262144 here): 10-12 ms each, while the sandbox is frozen. When
 *    the namespace holds no entry (its nf_conntrack_count, read from inside it, is 0) the answer
 *    is known to be empty, so the socket CRIU opens for it is one end of a unix seqpacket pair
 *    whose other end already holds that answer: one NLMSG_DONE with CRIU's sequence number.
 *    seqpacket sendmsg ignores the netlink address CRIU sends the request to. Grove sets the
 *    variable only for dumps that open no other netfilter socket: the namespace is external
 *    (no nftables listing) and the dump takes no network lock (no nftables table).
 *
 * 8. Started before the freeze (GROVE_START_FD=<fd>, dumps). Starting CRIU costs about 5 ms
 *    here (the loader maps and relocates its 22 libraries) before it does anything; in a dump
 *    that is time the sandbox spends frozen. So Grove starts the dump's CRIU first and freezes
 *    the sandbox after: this constructor, which runs once the loader is done and before CRIU's
 *    main, says "r" on the inherited socket and waits for one byte back. "g" lets CRIU go on;
 *    anything else, or the socket closed (Grove dropped the dump, or died), exits at once,
 *    before CRIU has read an argument or opened a file.
 *
 * 10. Lazy pages copied in the background only once the restored tree is quiet
 *    (GROVE_LAZY_QUIET_MS=<ms>, lazy-pages daemons). Once a restore is done, CRIU's lazy-pages
 *    daemon copies the pages not yet faulted in, one chunk after another, with a poll of its
 *    sockets that does not wait (epoll_wait with timeout 0) between chunks: from the first
 *    branch of a fork on, each daemon takes a core while the next branches are still being
 *    restored and the first ones asked to answer. Asked, such a poll waits instead until the
 *    tree has gone that long without a fault (or any other event) since the last one, and
 *    since the restore finished; at most ten times that after the restore, it no longer waits.
 *    Faults are served as they come, as before; only the background copy is put off. SIGWINCH
 *    (ignored by default, so a shell around the daemon lets it pass) ends the waiting for good:
 *    Grove sends it when something needs the branch's memory whole, a snapshot of the branch.
 *
 * 6. tmpfs archives without gzip (GROVE_PLAIN_TMPFS_ARCHIVES=1, dumps). CRIU saves each tmpfs
 *    mount with `tar --create --gzip` and restores it with `tar --extract --gzip`, and GNU tar
 *    runs gzip as a process of its own: 2.6 ms of each archive's 4.3 here, for a sandbox's few
 *    small files, three times in every dump (frozen) and every restore. CRIU runs tar with
 *    execvp, so a dump that asks drops --gzip there; an extract drops it only when its input
 *    does not start with gzip's magic, so snapshots written either way restore. The images
 *    keep CRIU's names; Grove's store compresses them. tar runs without the shim preloaded.
 *
 * 11. One CRIU loaded, forked for each restore and lazy-pages daemon (GROVE_ZYGOTE_FD=<fd>).
 *    Starting CRIU costs about 4.5 ms of CPU (the kernel's exec, then the loader mapping and
 *    relocating its 22 libraries), twice in every branch of a fork. Grove starts one CRIU with
 *    this variable and keeps it: before CRIU's main (this shim's __libc_start_main), it says
 *    "r" on the inherited SOCK_SEQPACKET socket and reads requests, each one message: a flags
 *    byte, then the arguments, each ending in NUL, and, passed with it, the socket to report on
 *    and maybe a network namespace. For each it forks a waiter that forks CRIU's process: that
 *    one takes the namespace at fd 4, closes every other descriptor but the shim's, opts into
 *    KSM if asked, shows the arguments as its command line (a restarted Grove finds a
 *    predecessor's CRIU by them) and goes on into CRIU's main with them; the waiter writes its
 *    own pid, then CRIU's wait status, 4 bytes each, to the report socket and exits. A
 *    lazy-pages daemon's request (ZYGOTE_LAZY; Grove sends them unless told not to, see
 *    criu/zygote.rs) starts with two more strings, its status file and its quiet wait (part
 *    10): its waiter takes the place of the shell Grove otherwise runs around it (own process
 *    group, a command line that names it, the status written there). The zygote exits
 *    when its socket closes (Grove stopped or died); CRIUs under way go on. Orphans, the
 *    restored trees included, go to Grove, a subreaper.
 *
 * 12. tmpfs archives without tar (tmpfs-archive.c; the plain archives of part 6). Where CRIU's
 *    child would exec tar for a plain archive, it writes or extracts the archive itself and
 *    exits; what it does not handle (hard links, holes, long names...) still goes to tar, with
 *    the same arguments. GROVE_TMPFS_ARCHIVER=tar (Grove's environment) leaves every archive
 *    to tar.
 *
 * 13. Page scans of plain anonymous memory without the struct page walk (tracked dumps, with
 *    part 4). CRIU's PAGEMAP_SCAN asks the kernel to leave out file pages (PAGE_IS_FILE), and
 *    the kernel can tell a file page only from its struct page: for a 256 MiB heap that is
 *    65,536 struct pages read, 3-4 ms of the frozen window here, against 0.8 ms for the same
 *    scan without the question. In a private anonymous VMA (no file, not shared, no special
 *    mapping such as [vdso]) no page is a file page (KSM pages and the zero page are not
 *    either; PAGE_IS_PFNZERO stays asked), so for a scan of 1 MiB or more lying inside one such
 *    VMA, as CRIU's scan of a large VMA does, the question is dropped: the answer is the same.
 *    The VMA is looked up with PROCMAP_QUERY (6.11+) on the process's maps; anything else (a
 *    smaller or wider range, another kind of VMA, a failed lookup) is asked as CRIU asked.
 *
 * 14. The dumped processes' smaps read ahead (smaps-ahead.c; GROVE_READ_AHEAD_SMAPS=1,
 *    tracked dumps started before the freeze). Once Grove says "g" (part 8) the tree is frozen,
 *    and a thread reads every process's smaps but the root's (the kernel's page-table walk for
 *    Rss: 3.7-5 ms for a 256 MiB heap) while CRIU dumps the processes before it; CRIU's open of
 *    that smaps then returns what the thread read.
 *
 * 15. Pages written beside CRIU (page-writer.c; GROVE_ASYNC_PAGE_WRITES=1, tracked dumps, with
 *    part 7). The pipe part 7 moves into an image in one splice is moved instead, by reference,
 *    into a pipe of a writer thread's, and CRIU's file position past it; the thread copies the
 *    pages into the image at their offset while CRIU dumps on (the sandbox cannot change them:
 *    it stays frozen until CRIU has exited), and CRIU's exit waits for it. CRIU's own writes
 *    into the pages (ptrace pokes) wait until the pages taken before are written. A failed
 *    write fails the dump.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <stdint.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <sys/ioctl.h>
#include <time.h>
#include <sys/socket.h>
#include <linux/netlink.h>
#include <netinet/in.h>
#include <unistd.h>
#include <sys/stat.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>

#include "page-writer.h"
#include "smaps-ahead.h"
#include "tmpfs-archive.h"

/* Whether `s` ends in `tail`. */
static int ends_with(const char *s, const char *tail)
{
	size_t n = strlen(s), t = strlen(tail);
	return n >= t && strcmp(s + n - t, tail) == 0;
}

/* Whether Grove asked for a part: its variable is exactly "1". */
static int asked(const char *name)
{
	const char *v = getenv(name);
	return v && strcmp(v, "1") == 0;
}

/* ---- 8: started before the freeze ---- */

/* CRIU never exits with it: a dump Grove dropped before it began. */
#define GROVE_NOT_STARTED 75

__attribute__((constructor)) static void wait_for_start(void)
{
	const char *v = getenv("GROVE_START_FD");
	if (!v)
		return;
	char *end;
	long fd = strtol(v, &end, 10);
	unsetenv("GROVE_START_FD");
	if (*v == '\0' || *end != '\0' || fd < 0 || fd > 1024)
		_exit(GROVE_NOT_STARTED);
	char go = 'r';
	long r;
	do
		r = syscall(SYS_write, (int)fd, &go, 1);
	while (r < 0 && errno == EINTR);
	if (r != 1)
		_exit(GROVE_NOT_STARTED);
	do
		r = syscall(SYS_read, (int)fd, &go, 1);
	while (r < 0 && errno == EINTR);
	syscall(SYS_close, (int)fd);
	if (r != 1 || go != 'g')
		_exit(GROVE_NOT_STARTED);
#ifdef GROVE_SHIM_UFFD_WP
	/* The tree is frozen now (part 14). */
	smaps_ahead_start();
#endif
}

/* ---- 11: one CRIU loaded, forked for each restore and lazy-pages daemon ---- */

/* The descriptor a restore's network namespace is given at (criu::NETNS_FD). */
#define ZYGOTE_NETNS_FD 4
/* A request's flags: opt CRIU's process into KSM; a namespace comes with it; a lazy-pages
 * daemon, whose arguments follow two strings: where its exit status goes, and its quiet wait. */
#define ZYGOTE_MERGE 1
#define ZYGOTE_NETNS 2
#define ZYGOTE_LAZY 4
/* A lazy-pages daemon's waiter shows this, then the daemon's arguments (criu::is_lazy_helper). */
#define LAZY_HELPER_NAME "grove-lazy-pages"

static void arm_lazy_quiet(void);
#define ZYGOTE_MAX_REQUEST 65536
#define ZYGOTE_MAX_ARGS 1024
#ifndef PR_SET_MEMORY_MERGE
#define PR_SET_MEMORY_MERGE 67
#endif

static ssize_t write_all(int fd, const void *buf, size_t n)
{
	ssize_t r;
	do
		r = write(fd, buf, n);
	while (r < 0 && errno == EINTR);
	return r;
}

/* What /proc/<pid>/cmdline shows: the NUL-separated strings from start to end, which must lie in
 * anonymous memory (the kernel reads them so). A restarted groved finds a killed predecessor's
 * CRIU by its arguments (runtime/src/recover.rs). PR_SET_MM_MAP, unlike the single
 * PR_SET_MM_ARG_*, needs no CAP_SYS_RESOURCE; the other fields are given as they are. */
static int set_cmdline(char *start, char *end)
{
	char stat[1024];
	int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t n = read(fd, stat, sizeof(stat) - 1);
	close(fd);
	if (n <= 0)
		return -1;
	stat[n] = '\0';
	/* Fields by proc(5)'s numbers; the name (2) may hold spaces, so count after its ')'. */
	char *p = strrchr(stat, ')');
	unsigned long long f[53] = {0};
	int i = 2;
	while (p && i < 52 && (p = strchr(p, ' '))) {
		p++;
		f[++i] = strtoull(p, NULL, 10);
	}
	if (i < 51)
		return -1;
	struct prctl_mm_map m = {
		.start_code = f[26],
		.end_code = f[27],
		.start_stack = f[28],
		.start_data = f[45],
		.end_data = f[46],
		.start_brk = f[47],
		.brk = (uint64_t)syscall(SYS_brk, 0),
		.arg_start = (uintptr_t)start,
		.arg_end = (uintptr_t)end,
		.env_start = f[50],
		.env_end = f[51],
		.exe_fd = (uint32_t)-1,
	};
	return prctl(PR_SET_MM, PR_SET_MM_MAP, (unsigned long)&m, sizeof(m), 0);
}

/* In CRIU's process: the descriptors it is started with, then its arguments, NULL-terminated
 * and followed by the environment (what a kernel-made argv is followed by). */
static char **zygote_child(int netns, int flags, const char *quiet, char *args, size_t len,
			   int *argc)
{
	if (flags & ZYGOTE_NETNS) {
		if (netns == ZYGOTE_NETNS_FD) {
			if (fcntl(netns, F_SETFD, 0) < 0)
				_exit(127);
		} else if (dup2(netns, ZYGOTE_NETNS_FD) < 0) {
			_exit(127);
		}
	}
	int keep = (flags & ZYGOTE_NETNS) ? ZYGOTE_NETNS_FD : 3;
	if (syscall(SYS_close_range, keep + 1, ~0U, 0) < 0)
		_exit(127);
	if ((flags & ZYGOTE_MERGE) && prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0) < 0)
		_exit(127);
	if (quiet) {
		if (setenv("GROVE_LAZY_QUIET_MS", quiet, 1) < 0)
			_exit(127);
		arm_lazy_quiet();
	}
	int n = 0;
	for (size_t i = 0; i < len; i++)
		n += args[i] == '\0';
	size_t envc = 0;
	while (environ[envc])
		envc++;
	char **argv = calloc((size_t)n + 1 + envc + 1, sizeof(char *));
	char *p = malloc(len); /* on the heap: anonymous memory, for set_cmdline */
	if (!argv || !p)
		_exit(127);
	args = memcpy(p, args, len);
	for (int i = 0; i < n; i++) {
		argv[i] = p;
		p += strlen(p) + 1;
	}
	memcpy(argv + n + 1, environ, envc * sizeof(char *));
	if (set_cmdline(args, args + len) < 0)
		_exit(127);
	*argc = n;
	return argv;
}

/* A request's descriptors, in the order sent: the report socket, then the namespace if any. */
static int received_fds(struct msghdr *m, int fds[2])
{
	int nfds = 0;
	for (struct cmsghdr *h = CMSG_FIRSTHDR(m); h; h = CMSG_NXTHDR(m, h)) {
		if (h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS)
			continue;
		int got = (int)((h->cmsg_len - CMSG_LEN(0)) / sizeof(int));
		for (int i = 0; i < got; i++) {
			int fd;
			memcpy(&fd, CMSG_DATA(h) + i * sizeof(int), sizeof(int));
			if (nfds < 2)
				fds[nfds++] = fd;
			else
				close(fd);
		}
	}
	return nfds;
}

/* A lazy-pages daemon's waiter, as the shell Grove otherwise starts around it: in a process group
 * of its own with the daemon (signals to Grove's spare them; Grove's signal the group), with a
 * command line that names it, and the daemon's exit status, as a shell's $?, in `status_path`
 * once it ends: the daemon outlives a crash of Grove, and the next one reads it there. */
static void lazy_waiter_setup(char *args, size_t len)
{
	size_t name = sizeof(LAZY_HELPER_NAME);
	char *line = malloc(name + len);
	if (setpgid(0, 0) < 0 || !line)
		_exit(127);
	memcpy(line, LAZY_HELPER_NAME, name);
	memcpy(line + name, args, len);
	if (set_cmdline(line, line + name + len) < 0)
		_exit(127);
}

static void lazy_waiter_record(const char *status_path, int status)
{
	int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
	char text[16];
	int len = snprintf(text, sizeof(text), "%d\n", code);
	int fd = open(status_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd >= 0) {
		write_all(fd, text, (size_t)len);
		close(fd);
	}
}

/* The zygote's loop: returns only in a CRIU process, with its arguments. */
static char **zygote(int ctl, int *argc, char **argv)
{
	static char buf[ZYGOTE_MAX_REQUEST];
	/* Its own command line without the loader's part, which also proves that each CRIU's can be
	 * set. Where it cannot, it never says it is ready, and Grove starts each CRIU itself. */
	char *last = argv[*argc - 1];
	if (set_cmdline(argv[0], last + strlen(last) + 1) < 0)
		_exit(GROVE_NOT_STARTED);
	signal(SIGCHLD, SIG_IGN); /* the waiters are reaped by the kernel */
	if (write_all(ctl, "r", 1) != 1)
		_exit(0);
	for (;;) {
		union {
			char space[CMSG_SPACE(2 * sizeof(int))];
			struct cmsghdr align;
		} c;
		struct iovec iov = {.iov_base = buf, .iov_len = sizeof(buf)};
		struct msghdr m = {.msg_iov = &iov,
				   .msg_iovlen = 1,
				   .msg_control = c.space,
				   .msg_controllen = sizeof(c.space)};
		ssize_t n = recvmsg(ctl, &m, MSG_CMSG_CLOEXEC);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			_exit(0); /* Grove is gone */
		int fds[2] = {-1, -1};
		int nfds = received_fds(&m, fds);
		int flags = (unsigned char)buf[0];
		int args = 0;
		for (ssize_t i = 1; i < n; i++)
			args += buf[i] == '\0';
		int lazy = flags & ZYGOTE_LAZY;
		/* Well formed: not cut short, arguments ending in NUL, the descriptors it says. */
		int ok = !(m.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) && n >= 2 && buf[n - 1] == '\0' &&
			 args > (lazy ? 2 : 0) && args <= ZYGOTE_MAX_ARGS &&
			 (flags & ~(ZYGOTE_MERGE | ZYGOTE_NETNS | ZYGOTE_LAZY)) == 0 &&
			 nfds == ((flags & ZYGOTE_NETNS) ? 2 : 1);
		pid_t waiter = ok ? fork() : -1;
		if (waiter == 0) {
			close(ctl);
			signal(SIGCHLD, SIG_DFL);
			char *a = buf + 1, *status_path = NULL, *quiet = NULL;
			if (lazy) {
				status_path = a;
				a += strlen(a) + 1;
				quiet = a;
				a += strlen(a) + 1;
			}
			size_t alen = (size_t)(buf + n - a);
			if (lazy)
				lazy_waiter_setup(a, alen);
			/* Its pid first (the daemon's process group), its CRIU's status when it ends. */
			int32_t me = (int32_t)getpid();
			send(fds[0], &me, sizeof(me), MSG_NOSIGNAL);
			pid_t criu = fork();
			if (criu == 0) {
				close(fds[0]);
				return zygote_child(fds[1], flags, quiet, a, alen, argc);
			}
			int status = 127 << 8; /* as a shell reports a command it could not start */
			if (criu > 0) {
				pid_t r;
				do
					r = waitpid(criu, &status, 0);
				while (r < 0 && errno == EINTR);
			}
			if (lazy)
				lazy_waiter_record(status_path, status);
			/* MSG_NOSIGNAL: Grove may be gone. */
			send(fds[0], &status, sizeof(status), MSG_NOSIGNAL);
			_exit(0);
		}
		/* Not run, or run by the waiter: the report socket closes here either way. */
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
	}
}

typedef int (*start_main_fn)(int (*)(int, char **, char **), int, char **, void (*)(void),
			     void (*)(void), void (*)(void), void *);

int __libc_start_main(int (*main)(int, char **, char **), int argc, char **argv,
		      void (*init)(void), void (*fini)(void), void (*rtld_fini)(void),
		      void *stack_end)
{
	start_main_fn real = (start_main_fn)dlsym(RTLD_NEXT, "__libc_start_main");
	const char *v = getenv("GROVE_ZYGOTE_FD");
	if (v) {
		char *end;
		long fd = strtol(v, &end, 10);
		if (*v == '\0' || *end != '\0' || fd < 0 || fd > 1024)
			_exit(GROVE_NOT_STARTED);
		unsetenv("GROVE_ZYGOTE_FD");
		argv = zygote((int)fd, &argc, argv);
	}
	return real(main, argc, argv, init, fini, rtld_fini, stack_end);
}

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

static int is_own_mount_ns(int fd)
{
	struct stat target, own;
	if (fstat(fd, &target) < 0 || stat("/proc/self/ns/mnt", &own) < 0)
		return 0;
	return target.st_dev == own.st_dev && target.st_ino == own.st_ino;
}

/* Parts 14 and 15 run threads of their own, and the kernel lets only a single-threaded process
 * enter another mount, user or time namespace (EINVAL or EUSERS otherwise): before CRIU does,
 * they finish and end, and this waits until the kernel counts their threads gone. */
#define GROVE_CLONE_NEWTIME 0x80
static void single_threaded(void)
{
	if (!(page_writer_stop() | smaps_ahead_stop()))
		return;
	for (int tries = 0; tries < 10000; tries++) {
		char buf[2048];
		int fd = (int)syscall(SYS_openat, AT_FDCWD, "/proc/self/status", O_RDONLY | O_CLOEXEC);
		if (fd < 0)
			return;
		long n = syscall(SYS_read, fd, buf, sizeof(buf) - 1);
		syscall(SYS_close, fd);
		if (n <= 0)
			return;
		buf[n] = '\0';
		const char *t = strstr(buf, "\nThreads:");
		if (!t || atoi(t + strlen("\nThreads:")) <= 1)
			return;
		struct timespec pause = {0, 10000};
		nanosleep(&pause, NULL);
	}
}

int unshare(int flags)
{
	static int (*real)(int);
	if (!real)
		real = (int (*)(int))dlsym(RTLD_NEXT, "unshare");
	if (flags & (CLONE_NEWNS | CLONE_NEWUSER | CLONE_FS))
		single_threaded();
	return real(flags);
}

int setns(int fd, int nstype)
{
	static int (*real)(int, int);
	if (!real)
		real = (int (*)(int, int))dlsym(RTLD_NEXT, "setns");
	if (nstype == 0 || (nstype & (CLONE_NEWNS | CLONE_NEWUSER | GROVE_CLONE_NEWTIME)))
		single_threaded();
	int r = real(fd, nstype);
	if (r < 0 && errno == EINVAL && (nstype == CLONE_NEWNS || nstype == 0) &&
	    is_own_mount_ns(fd)) {
		errno = 0;
		return 0;
	}
	return r;
}

/* Part 15: CRIU's pokes into a dumped process's memory wait for the pages taken before them
 * (page-writer.c). */
long ptrace(enum __ptrace_request request, ...)
{
	static long (*real)(enum __ptrace_request, pid_t, void *, void *);
	if (!real)
		real = (long (*)(enum __ptrace_request, pid_t, void *, void *))dlsym(RTLD_NEXT, "ptrace");
	va_list ap;
	va_start(ap, request);
	pid_t pid = va_arg(ap, pid_t);
	void *addr = va_arg(ap, void *);
	void *data = va_arg(ap, void *);
	va_end(ap);
	if (request == PTRACE_POKETEXT || request == PTRACE_POKEDATA)
		page_writer_drain();
	return real(request, pid, addr, data);
}

/* ---- 10: lazy pages copied in the background once the tree is quiet ---- */

/* -1 until read from the environment. */
static long quiet_ms = -1;

static long lazy_quiet_ms(void)
{
	if (quiet_ms < 0) {
		const char *v = getenv("GROVE_LAZY_QUIET_MS");
		char *end;
		long n = v ? strtol(v, &end, 10) : 0;
		quiet_ms = (v && *v && *end == '\0' && n > 0 && n <= 10000) ? n : 0;
	}
	return quiet_ms;
}

static long now_ms(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static int (*real_epoll_wait)(int, struct epoll_event *, int, int);

/* Set by SIGWINCH: the branch's memory is wanted whole, the background copy waits no more. */
static volatile sig_atomic_t lazy_hurry;

static void on_hurry(int sig)
{
	(void)sig;
	lazy_hurry = 1;
}

/* Reads GROVE_LAZY_QUIET_MS (again: a daemon forked from the zygote gets it late) and, where it
 * asks for a wait, takes SIGWINCH. */
static void arm_lazy_quiet(void)
{
	quiet_ms = -1;
	if (lazy_quiet_ms() > 0) {
		/* SA_RESTART: whatever else the process waits in goes on; epoll_wait is never
		 * restarted, so a waiting poll returns at once. */
		struct sigaction sa;
		memset(&sa, 0, sizeof(sa));
		sa.sa_handler = on_hurry;
		sa.sa_flags = SA_RESTART;
		sigemptyset(&sa.sa_mask);
		sigaction(SIGWINCH, &sa, NULL);
	}
}

__attribute__((constructor)) static void resolve_epoll_wait(void)
{
	real_epoll_wait = (int (*)(int, struct epoll_event *, int, int))dlsym(RTLD_NEXT, "epoll_wait");
	arm_lazy_quiet();
}

int epoll_wait(int epfd, struct epoll_event *events, int max, int timeout)
{
	/* When the first poll that does not wait came, and when the last event did. */
	static long first = -1, last_event = -1;
	long quiet = lazy_quiet_ms();
	if (timeout != 0 || quiet == 0 || lazy_hurry)
		return real_epoll_wait(epfd, events, max, timeout);
	long now = now_ms();
	if (first < 0)
		first = last_event = now;
	long until = last_event + quiet;
	if (until > first + 10 * quiet)
		until = first + 10 * quiet;
	int wait = until > now ? (int)(until - now) : 0;
	int r = real_epoll_wait(epfd, events, max, wait);
	if (r < 0 && errno == EINTR && wait > 0)
		return 0; /* what the poll CRIU asked for, which does not wait, would have said */
	if (r > 0)
		last_event = now_ms();
	return r;
}

/* ---- 5: an empty conntrack table ---- */

#define GROVE_NETLINK_NETFILTER 12
#define GROVE_CR_NLMSG_SEQ 24680 /* criu/include/libnetlink.h */

static int netns_conntrack_empty(void)
{
	char buf[32];
	int fd = open("/proc/sys/net/netfilter/nf_conntrack_count", O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
	close(fd);
	return n == 2 && buf[0] == '0' && buf[1] == '\n';
}

/* A socket whose first read is the end of an empty netlink dump. */
static int empty_dump_socket(int type)
{
	struct {
		uint32_t len;
		uint16_t type, flags;
		uint32_t seq, pid;
		int32_t status;
	} done = {sizeof(done), 3 /* NLMSG_DONE */, 2 /* NLM_F_MULTI */, GROVE_CR_NLMSG_SEQ, 0, 0};
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_SEQPACKET | (type & SOCK_CLOEXEC), 0, sv) < 0)
		return -1;
	if (write(sv[1], &done, sizeof(done)) != (ssize_t)sizeof(done)) {
		close(sv[0]);
		close(sv[1]);
		return -1;
	}
	/* sv[1] stays open (a closed peer fails the request's sendmsg with EPIPE); it goes with
	 * this short-lived process. */
	return sv[0];
}

int socket(int domain, int type, int protocol)
{
	static int (*real)(int, int, int);
	if (!real)
		real = (int (*)(int, int, int))dlsym(RTLD_NEXT, "socket");
	if (domain == AF_NETLINK && protocol == GROVE_NETLINK_NETFILTER &&
	    (type & 0xf) == SOCK_RAW) {
		if (asked("GROVE_EMPTY_CONNTRACK") && netns_conntrack_empty()) {
			int fd = empty_dump_socket(type);
			if (fd >= 0)
				return fd;
		}
	}
	return real(domain, type, protocol);
}

/* ---- 4: soft-dirty from userfaultfd write-protect ---- */

static int uffd_wp(void)
{
	static int on = -1;
	if (on < 0)
		on = asked("GROVE_UFFD_WP");
	return on;
}

#ifdef GROVE_SHIM_UFFD_WP
/* PAGEMAP_SCAN (linux/fs.h, 6.7+), declared here: the build host's headers may predate it. */
#define GROVE_PAGEMAP_SCAN _IOWR('f', 16, struct grove_pm_scan_arg)
#define GROVE_PAGE_IS_WPALLOWED (1 << 0)
#define GROVE_PAGE_IS_WRITTEN (1 << 1)
#define GROVE_PAGE_IS_SOFT_DIRTY (1 << 7)
#define GROVE_PME_SOFT_DIRTY (1ULL << 55)

struct grove_page_region {
	uint64_t start, end, categories;
};

struct grove_pm_scan_arg {
	uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages;
	uint64_t category_inverted, category_mask, category_anyof_mask, return_mask;
};

/* Open pagemap files, by fd. */
#define TRACKED_FDS 4096
static unsigned char pagemap_fd[TRACKED_FDS];

/* ---- 13: scans of plain anonymous memory ---- */

#define GROVE_PAGE_IS_FILE (1 << 2)
/* PROCMAP_QUERY (linux/fs.h, 6.11+), declared here for the same reason. */
#define GROVE_PROCMAP_QUERY 0xC0686611UL
#define GROVE_PROCMAP_QUERY_VMA_SHARED 0x08
/* Scans smaller than this are cheap either way: asked as CRIU asked. */
#define GROVE_ANON_SCAN_MIN (1UL << 20)

struct grove_procmap_query {
	uint64_t size, query_flags, query_addr, vma_start, vma_end, vma_flags, vma_page_size;
	uint64_t vma_offset, inode;
	uint32_t dev_major, dev_minor, vma_name_size, build_id_size;
	uint64_t vma_name_addr, build_id_addr;
};

/* The pid in a pagemap file's path as the kernel names it ("/proc/<pid>/pagemap"; CRIU opens
 * it under its /proc directory of the pid); 0 for any other shape. */
static pid_t pagemap_path_pid(const char *path)
{
	if (!ends_with(path, "/pagemap"))
		return 0;
	size_t end = strlen(path) - strlen("/pagemap"), start = end;
	while (start > 0 && path[start - 1] >= '0' && path[start - 1] <= '9')
		start--;
	if (start == end || end - start > 9 || (start > 0 && path[start - 1] != '/'))
		return 0;
	pid_t pid = 0;
	for (size_t i = start; i < end; i++)
		pid = pid * 10 + (path[i] - '0');
	return pid;
}

static int is_pagemap_path(const char *path)
{
	if (!path)
		return 0;
	const char *base = strrchr(path, '/');
	return strcmp(base ? base + 1 : path, "pagemap") == 0;
}

/* ---- 7: page writes coalesced ---- */

static int coalesce_pages(void)
{
	static int on = -1;
	if (on < 0)
		on = asked("GROVE_COALESCE_PAGE_WRITES");
	return on;
}

/* ---- 15: pages written beside CRIU (page-writer.c) ---- */

static int async_page_writes(void)
{
	static int on = -1;
	if (on < 0)
		on = asked("GROVE_ASYNC_PAGE_WRITES");
	return on;
}

/* ---- 9: whether Grove asked for it (its wrappers come further down) ---- */

static int empty_tcp_diag(void)
{
	static int on = -1;
	if (on < 0)
		on = asked("GROVE_EMPTY_TCP_DIAG");
	return on;
}

/* Open pages images (CRIU's "pages-<id>.img"), by fd. */
static unsigned char pages_img_fd[TRACKED_FDS];

static int is_pages_img_path(const char *path)
{
	if (!path)
		return 0;
	const char *base = strrchr(path, '/');
	base = base ? base + 1 : path;
	size_t n = strlen(base);
	return strncmp(base, "pages-", 6) == 0 && n > 10 && strcmp(base + n - 4, ".img") == 0;
}

static int is_pages_img_fd(int fd)
{
	return fd >= 0 && fd < TRACKED_FDS && pages_img_fd[fd];
}

static int note_open(int fd, const char *path)
{
	if (fd >= 0 && path && ends_with(path, "smaps"))
		fd = smaps_ahead_take(fd);
	if (fd >= 0 && fd < TRACKED_FDS) {
		if (uffd_wp())
			pagemap_fd[fd] = is_pagemap_path(path);
		if (coalesce_pages())
			pages_img_fd[fd] = is_pages_img_path(path);
	}
	return fd;
}

static int is_pagemap_fd(int fd)
{
	return fd >= 0 && fd < TRACKED_FDS && pagemap_fd[fd];
}

/* Every whole entry read from a pagemap file reads soft-dirty. */
static ssize_t all_dirty(int fd, void *buf, ssize_t n, off_t off)
{
	if (n <= 0 || !is_pagemap_fd(fd) || off % 8)
		return n;
	uint64_t *e = buf;
	for (ssize_t i = 0; i < n / 8; i++)
		e[i] |= GROVE_PME_SOFT_DIRTY;
	return n;
}

/*
 * The wrappers below sit on CRIU's hottest calls, some made in CLONE_VM children on small
 * stacks: their next symbols are resolved once, before main, never lazily inside one.
 */
static int (*real_ioctl)(int, unsigned long, ...);
static ssize_t (*real_read)(int, void *, size_t);
static ssize_t (*real_pread)(int, void *, size_t, off_t);
static ssize_t (*real_pread64)(int, void *, size_t, off_t);
static int (*real_close)(int);
static int (*real_openat)(int, const char *, int, ...);
static int (*real_openat64)(int, const char *, int, ...);
static ssize_t (*real_splice)(int, loff_t *, int, loff_t *, size_t, unsigned int);
static ssize_t (*real_sendmsg)(int, const struct msghdr *, int);
static ssize_t (*real_recvmsg)(int, struct msghdr *, int);

__attribute__((constructor)) static void resolve_next(void)
{
	real_ioctl = (int (*)(int, unsigned long, ...))dlsym(RTLD_NEXT, "ioctl");
	real_read = (ssize_t(*)(int, void *, size_t))dlsym(RTLD_NEXT, "read");
	real_pread = (ssize_t(*)(int, void *, size_t, off_t))dlsym(RTLD_NEXT, "pread");
	real_pread64 = (ssize_t(*)(int, void *, size_t, off_t))dlsym(RTLD_NEXT, "pread64");
	real_close = (int (*)(int))dlsym(RTLD_NEXT, "close");
	real_openat = (int (*)(int, const char *, int, ...))dlsym(RTLD_NEXT, "openat");
	real_openat64 = (int (*)(int, const char *, int, ...))dlsym(RTLD_NEXT, "openat64");
	real_splice = (ssize_t(*)(int, loff_t *, int, loff_t *, size_t, unsigned int))dlsym(
		RTLD_NEXT, "splice");
	real_sendmsg = (ssize_t(*)(int, const struct msghdr *, int))dlsym(RTLD_NEXT, "sendmsg");
	real_recvmsg = (ssize_t(*)(int, struct msghdr *, int))dlsym(RTLD_NEXT, "recvmsg");
	uffd_wp();
	coalesce_pages();
	async_page_writes();
	empty_tcp_diag();
}

/* Whether [start, end) of the process whose pagemap is open at `pagemap` lies inside one
 * private anonymous VMA that is no special mapping: no page in it can be a file page. */
static int plain_anon_range(int pagemap, uint64_t start, uint64_t end)
{
	char path[64], target[64];
	snprintf(path, sizeof(path), "/proc/self/fd/%d", pagemap);
	ssize_t n = readlink(path, target, sizeof(target) - 1);
	if (n <= 0)
		return 0;
	target[n] = 0;
	pid_t pid = pagemap_path_pid(target);
	if (!pid)
		return 0;
	snprintf(path, sizeof(path), "/proc/%d/maps", (int)pid);
	int fd = real_openat(AT_FDCWD, path, O_RDONLY | O_CLOEXEC, 0);
	if (fd < 0)
		return 0;
	char name[32] = "";
	struct grove_procmap_query q = {
		.size = sizeof(q),
		.query_addr = start,
		.vma_name_size = sizeof(name),
		.vma_name_addr = (uint64_t)(uintptr_t)name,
	};
	int ok = real_ioctl(fd, GROVE_PROCMAP_QUERY, &q) == 0;
	real_close(fd);
	if (!ok || q.vma_start > start || q.vma_end < end)
		return 0;
	if (q.inode || q.dev_major || q.dev_minor || (q.vma_flags & GROVE_PROCMAP_QUERY_VMA_SHARED))
		return 0;
	/* Unnamed, [heap], [stack] or a name the process gave it ([anon:...]); [vdso], [vvar] and
	 * the like are the kernel's pages. */
	if (q.vma_name_size == 0)
		return 1;
	return strcmp(name, "[heap]") == 0 || strcmp(name, "[stack]") == 0 ||
	       strncmp(name, "[anon:", 6) == 0;
}

int ioctl(int fd, unsigned long req, ...)
{
	int (*real)(int, unsigned long, ...) = real_ioctl;
	va_list ap;
	va_start(ap, req);
	void *arg = va_arg(ap, void *);
	va_end(ap);
	if (req != GROVE_PAGEMAP_SCAN || !uffd_wp() || !arg)
		return real(fd, req, arg);
	struct grove_pm_scan_arg *a = arg;
	uint64_t asked = a->return_mask;
	if (!(asked & GROVE_PAGE_IS_SOFT_DIRTY))
		return real(fd, req, arg);
	/* WPALLOWED too: a page outside a registered VMA is dirty whatever the kernel says of
	 * WRITTEN there (today it says written; a later kernel might not). */
	a->return_mask = (asked & ~(uint64_t)GROVE_PAGE_IS_SOFT_DIRTY) | GROVE_PAGE_IS_WRITTEN |
			 GROVE_PAGE_IS_WPALLOWED;
	/* Part 13: file pages left out where there can be none. */
	uint64_t inverted = a->category_inverted, mask = a->category_mask;
	const uint64_t file = GROVE_PAGE_IS_FILE;
	if ((mask & file) && (inverted & file) && !((a->category_anyof_mask | asked) & file) &&
	    a->end > a->start && a->end - a->start >= GROVE_ANON_SCAN_MIN && is_pagemap_fd(fd) &&
	    plain_anon_range(fd, a->start, a->end)) {
		a->category_inverted &= ~file;
		a->category_mask &= ~file;
	}
	int r = real(fd, req, arg);
	a->return_mask = asked;
	a->category_inverted = inverted;
	a->category_mask = mask;
	if (r <= 0)
		return r;
	struct grove_page_region *v = (struct grove_page_region *)(uintptr_t)a->vec;
	for (int i = 0; i < r; i++) {
		uint64_t c = v[i].categories;
		int written = (c & GROVE_PAGE_IS_WRITTEN) || !(c & GROVE_PAGE_IS_WPALLOWED);
		c &= ~(uint64_t)(GROVE_PAGE_IS_WRITTEN | GROVE_PAGE_IS_WPALLOWED | GROVE_PAGE_IS_SOFT_DIRTY);
		if (written)
			c |= GROVE_PAGE_IS_SOFT_DIRTY;
		v[i].categories = c & asked;
	}
	return r;
}

ssize_t read(int fd, void *buf, size_t n)
{
	ssize_t (*real)(int, void *, size_t) = real_read;
	if (!is_pagemap_fd(fd))
		return real(fd, buf, n);
	off_t off = lseek(fd, 0, SEEK_CUR);
	return all_dirty(fd, buf, real(fd, buf, n), off);
}

ssize_t __read_chk(int fd, void *buf, size_t n, size_t buflen)
{
	(void)buflen;
	return read(fd, buf, n);
}

ssize_t pread(int fd, void *buf, size_t n, off_t off)
{
	return all_dirty(fd, buf, real_pread(fd, buf, n, off), off);
}

ssize_t pread64(int fd, void *buf, size_t n, off_t off)
{
	return all_dirty(fd, buf, real_pread64(fd, buf, n, off), off);
}

ssize_t __pread64_chk(int fd, void *buf, size_t n, off_t off, size_t buflen)
{
	(void)buflen;
	return pread64(fd, buf, n, off);
}

ssize_t __pread_chk(int fd, void *buf, size_t n, off_t off, size_t buflen)
{
	(void)buflen;
	return pread(fd, buf, n, off);
}

/* Bytes moved from pipe `moved_in` into image `moved_out` that CRIU has not asked for yet. */
static int moved_in = -1, moved_out = -1;
static size_t moved;
/* A pages image whose content no longer follows CRIU's asks: every splice into it fails. */
static int broken_out = -1;

static void forget_fd(int fd)
{
	if (fd == broken_out)
		broken_out = -1;
	if (!moved)
		return;
	/* The image closed with bytes unclaimed: they follow every page CRIU placed, and nothing
	 * reads past those. The pipe closed with bytes unclaimed: pages CRIU writes into the image
	 * later would land after bytes it never placed. */
	if (fd == moved_in)
		broken_out = moved_out;
	if (fd == moved_in || fd == moved_out)
		moved = 0;
}

ssize_t splice(int in, loff_t *off_in, int out, loff_t *off_out, size_t len, unsigned int flags)
{
	if (out >= 0 && out == broken_out) {
		errno = EIO;
		return -1;
	}
	if (moved) {
		if (in != moved_in || out != moved_out || off_in || off_out) {
			broken_out = moved_out;
			moved = 0;
			errno = EIO;
			return -1;
		}
		size_t n = len < moved ? len : moved;
		moved -= n;
		return (ssize_t)n;
	}
	int queued = 0;
	if (!coalesce_pages() || off_in || off_out || !is_pages_img_fd(out) ||
	    real_ioctl(in, FIONREAD, &queued) < 0)
		return real_splice(in, off_in, out, off_out, len, flags);
	if (queued == 0) {
		/* An ask the pipe cannot meet (CRIU fills it first): a plain splice would wait for
		 * ever, with the tree frozen. */
		broken_out = out;
		errno = EIO;
		return -1;
	}
	if ((size_t)queued <= len)
		return real_splice(in, off_in, out, off_out, len, flags);
	size_t done = 0;
	if (async_page_writes()) {
		ssize_t taken = page_writer_take(in, out, (size_t)queued);
		if (taken > 0)
			done = (size_t)taken;
	}
	while (done < (size_t)queued) {
		ssize_t r = real_splice(in, NULL, out, NULL, (size_t)queued - done, flags);
		if (r < 0 && done == 0)
			return -1;
		if (r <= 0)
			break;
		done += (size_t)r;
	}
	if (done <= len)
		return (ssize_t)done;
	moved_in = in;
	moved_out = out;
	moved = done - len;
	return (ssize_t)len;
}

/* ---- 9: no TCP socket, answered without the walk ---- */

#define GROVE_NETLINK_SOCK_DIAG 4
#define GROVE_SOCK_DIAG_BY_FAMILY 20
#define GROVE_NLM_F_DUMP 0x300
#ifndef SIOCGSKNS
#define SIOCGSKNS 0x894C
#endif

struct grove_nlmsghdr {
	uint32_t len;
	uint16_t type, flags;
	uint32_t seq, pid;
};

/* linux/inet_diag.h's inet_diag_req_v2, up to what is read here. */
struct grove_inet_diag_req {
	uint8_t family, protocol, ext, pad;
	uint32_t states;
	unsigned char id[48];
};

/* The sock_diag socket whose next read is the end of an empty dump, and that dump's seq. */
static int done_fd = -1;
static uint32_t done_seq;

/* The number after `key` in a /proc/self/net file, or -1. */
static long net_count(const char *file, const char *key)
{
	char buf[512];
	int fd = real_openat(AT_FDCWD, file, O_RDONLY | O_CLOEXEC, 0);
	if (fd < 0)
		return -1;
	ssize_t n = real_read(fd, buf, sizeof(buf) - 1);
	real_close(fd);
	if (n <= 0)
		return -1;
	buf[n] = '\0';
	const char *at = strstr(buf, key);
	if (!at)
		return -1;
	char *end;
	long v = strtol(at + strlen(key), &end, 10);
	return end == at + strlen(key) ? -1 : v;
}

static int no_tcp_here(void)
{
	return net_count("/proc/thread-self/net/sockstat", "TCP: inuse ") == 0 &&
	       net_count("/proc/thread-self/net/sockstat", " tw ") == 0 &&
	       net_count("/proc/thread-self/net/sockstat6", "TCP6: inuse ") == 0;
}

/* Whether the network namespace `ns` (a descriptor) holds no TCP socket, read from inside it. CRIU
 * makes its diag socket in the dumped namespace and switches back to its own before it sends the
 * request, so the two differ: the thread enters the socket's namespace for the reads and returns. */
static int netns_has_no_tcp(int ns)
{
	struct stat target, own;
	if (fstat(ns, &target) < 0 || stat("/proc/thread-self/ns/net", &own) < 0)
		return 0;
	if (target.st_dev == own.st_dev && target.st_ino == own.st_ino)
		return no_tcp_here();
	int back = real_openat(AT_FDCWD, "/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC, 0);
	if (back < 0)
		return 0;
	if (syscall(SYS_setns, ns, CLONE_NEWNET) < 0) {
		real_close(back);
		return 0;
	}
	int none = no_tcp_here();
	if (syscall(SYS_setns, back, CLONE_NEWNET) < 0)
		abort(); /* CRIU would go on in the dumped namespace: fail the dump instead */
	real_close(back);
	return none;
}

/* A netlink socket of the sock_diag family: the descriptor of its network namespace, or -1. */
static int diag_socket_netns(int fd)
{
	int v;
	socklen_t len = sizeof(v);
	if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &v, &len) < 0 || v != AF_NETLINK)
		return -1;
	len = sizeof(v);
	if (getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &v, &len) < 0 || v != GROVE_NETLINK_SOCK_DIAG)
		return -1;
	return real_ioctl(fd, SIOCGSKNS);
}

/* A TCP dump request of CRIU's shape: one buffer, one message, all of it. */
static const struct grove_nlmsghdr *tcp_dump_request(const struct msghdr *msg)
{
	if (!msg || msg->msg_iovlen != 1 || !msg->msg_iov)
		return NULL;
	const struct iovec *iov = msg->msg_iov;
	if (iov->iov_len < sizeof(struct grove_nlmsghdr) + sizeof(struct grove_inet_diag_req))
		return NULL;
	const struct grove_nlmsghdr *h = iov->iov_base;
	const struct grove_inet_diag_req *r = (const void *)(h + 1);
	if (h->len != iov->iov_len || h->type != GROVE_SOCK_DIAG_BY_FAMILY ||
	    (h->flags & GROVE_NLM_F_DUMP) != GROVE_NLM_F_DUMP)
		return NULL;
	if ((r->family != AF_INET && r->family != AF_INET6) || r->protocol != IPPROTO_TCP)
		return NULL;
	return h;
}

ssize_t sendmsg(int fd, const struct msghdr *msg, int flags)
{
	const struct grove_nlmsghdr *h;
	if (empty_tcp_diag() && (h = tcp_dump_request(msg))) {
		int ns = diag_socket_netns(fd);
		int empty = ns >= 0 && netns_has_no_tcp(ns);
		if (ns >= 0)
			real_close(ns);
		if (empty) {
			done_fd = fd;
			done_seq = h->seq;
			return (ssize_t)h->len;
		}
	}
	return real_sendmsg(fd, msg, flags);
}

ssize_t recvmsg(int fd, struct msghdr *msg, int flags)
{
	if (fd != done_fd || fd < 0 || !msg || msg->msg_iovlen < 1 || !msg->msg_iov)
		return real_recvmsg(fd, msg, flags);
	struct {
		struct grove_nlmsghdr h;
		int32_t status;
	} done = {{sizeof(done), 3 /* NLMSG_DONE */, 2 /* NLM_F_MULTI */, done_seq, 0}, 0};
	if (msg->msg_iov[0].iov_len < sizeof(done))
		return real_recvmsg(fd, msg, flags);
	memcpy(msg->msg_iov[0].iov_base, &done, sizeof(done));
	if (msg->msg_name && msg->msg_namelen >= sizeof(struct sockaddr_nl)) {
		struct sockaddr_nl from = {.nl_family = AF_NETLINK};
		memcpy(msg->msg_name, &from, sizeof(from));
		msg->msg_namelen = sizeof(from);
	}
	msg->msg_controllen = 0;
	msg->msg_flags = 0;
	if (!(flags & MSG_PEEK))
		done_fd = -1;
	return (ssize_t)sizeof(done);
}

int close(int fd)
{
	if (fd >= 0 && fd < TRACKED_FDS) {
		pagemap_fd[fd] = 0;
		pages_img_fd[fd] = 0;
	}
	if (fd == done_fd)
		done_fd = -1;
	forget_fd(fd);
	return real_close(fd);
}

#define OPENAT(name)                                                                      \
	int name(int dirfd, const char *path, int flags, ...)                             \
	{                                                                                 \
		mode_t mode = 0;                                                          \
		if (flags & (O_CREAT | O_TMPFILE)) {                                      \
			va_list ap;                                                       \
			va_start(ap, flags);                                              \
			mode = va_arg(ap, mode_t);                                        \
			va_end(ap);                                                       \
		}                                                                         \
		return note_open(real_##name(dirfd, path, flags, mode), path);            \
	}
OPENAT(openat)
OPENAT(openat64)

#else
static int note_open(int fd, const char *path)
{
	(void)path;
	return fd;
}
#endif /* GROVE_SHIM_UFFD_WP */

/* ---- 3: the feature cache ---- */

static const char *kdat_path(const char *path, char *buf, size_t len)
{
	const char *to = getenv("GROVE_CRIU_KDAT");
	if (!path)
		return path;
	if (uffd_wp()) {
		/* A cache of its own: this mode's answer (dirty tracking on) must not leak out. */
		const char *base = to ? to : "/run/criu.kdat";
		if (strcmp(path, "/run/criu.kdat") == 0 && snprintf(buf, len, "%s.uffd-wp", base) < (int)len)
			return buf;
		if (strcmp(path, "/run/criu.kdat.tmp") == 0 &&
		    snprintf(buf, len, "%s.uffd-wp.tmp", base) < (int)len)
			return buf;
		return path;
	}
	if (!to)
		return path;
	if (strcmp(path, "/run/criu.kdat") == 0)
		return to;
	if (strcmp(path, "/run/criu.kdat.tmp") == 0 && snprintf(buf, len, "%s.tmp", to) < (int)len)
		return buf;
	return path;
}

#define KDAT_OPEN(name)                                                                   \
	int name(const char *path, int flags, ...)                                        \
	{                                                                                 \
		static int (*real)(const char *, int, ...);                               \
		if (!real)                                                                \
			real = (int (*)(const char *, int, ...))dlsym(RTLD_NEXT, #name);  \
		mode_t mode = 0;                                                          \
		if (flags & (O_CREAT | O_TMPFILE)) {                                      \
			va_list ap;                                                       \
			va_start(ap, flags);                                              \
			mode = va_arg(ap, mode_t);                                        \
			va_end(ap);                                                       \
		}                                                                         \
		char buf[4096];                                                           \
		return note_open(real(kdat_path(path, buf, sizeof(buf)), flags, mode), path); \
	}
KDAT_OPEN(open)
KDAT_OPEN(open64)

int rename(const char *from, const char *to)
{
	static int (*real)(const char *, const char *);
	if (!real)
		real = (int (*)(const char *, const char *))dlsym(RTLD_NEXT, "rename");
	char a[4096], b[4096];
	return real(kdat_path(from, a, sizeof(a)), kdat_path(to, b, sizeof(b)));
}

int unlink(const char *path)
{
	static int (*real)(const char *);
	if (!real)
		real = (int (*)(const char *))dlsym(RTLD_NEXT, "unlink");
	char buf[4096];
	return real(kdat_path(path, buf, sizeof(buf)));
}

/* ---- 6: tmpfs archives without gzip ---- */

/* CRIU's restore feeds the archive to tar on stdin (a regular file: the image). */
static int stdin_is_gzip(void)
{
	unsigned char magic[2];
	long at = syscall(SYS_lseek, 0, 0L, SEEK_CUR);
	if (at < 0)
		return 1; /* unknown: leave CRIU's command as it is */
	return syscall(SYS_pread64, 0, magic, sizeof(magic), at) != 2 || (magic[0] == 0x1f && magic[1] == 0x8b);
}

static int drop_gzip(char *const argv[])
{
	if (!argv[0] || !argv[1])
		return 0;
	if (strcmp(argv[1], "--create") == 0)
		return asked("GROVE_PLAIN_TMPFS_ARCHIVES");
	return strcmp(argv[1], "--extract") == 0 && !stdin_is_gzip();
}

/* CRIU's own tar options, each taking no value: any other leaves the archive to tar. */
static int known_option(const char *a)
{
	static const char *const known[] = { "--create",	  "--extract",	      "--gzip",
					     "--no-unquote",	  "--no-wildcards",   "--one-file-system",
					     "--check-links",	  "--preserve-permissions", "--sparse",
					     "--numeric-owner" };
	for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
		if (strcmp(a, known[i]) == 0)
			return 1;
	return 0;
}

/* Part 12: writes or extracts a plain archive in this process and exits; returns where tar is to
 * do it. A create's directory is its --directory (CRIU's is /proc/self/fd/0, the mount), the
 * archive goes to stdout; an extract reads stdin into its --directory. */
static void archive_in_process(char *const argv[])
{
	const char *v = getenv("GROVE_TMPFS_ARCHIVER");
	if (v && strcmp(v, "tar") == 0)
		return;
	const char *dir = NULL;
	int dot = 0;
	for (size_t i = 2; argv[i]; i++) {
		if (strcmp(argv[i], "--directory") == 0 && argv[i + 1] && !dir)
			dir = argv[++i];
		else if (strcmp(argv[i], ".") == 0 && !argv[i + 1])
			dot = 1;
		else if (!known_option(argv[i]))
			return;
	}
	if (!dir)
		return;
	if (strcmp(argv[1], "--create") == 0 && dot) {
		int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
		if (fd < 0)
			return;
		int r = tar_create(fd, STDOUT_FILENO);
		if (r == 0)
			_exit(0);
		if (r < 0) {
			dprintf(STDERR_FILENO, "grove shim: a tmpfs archive half written could not be undone\n");
			_exit(1);
		}
		close(fd);
	} else if (strcmp(argv[1], "--extract") == 0 && !dot && tar_extract(STDIN_FILENO, dir) == 0) {
		_exit(0);
	}
}

/* Runs in CRIU's forked child (cr_system), single-threaded, right before the exec. */
int execvp(const char *file, char *const argv[])
{
	static int (*real)(const char *, char *const[]);
	if (!real)
		real = (int (*)(const char *, char *const[]))dlsym(RTLD_NEXT, "execvp");
	if (!file || strcmp(file, "tar") != 0)
		return real(file, argv);
	unsetenv("LD_PRELOAD");
	if (!drop_gzip(argv))
		return real(file, argv);
	archive_in_process(argv);
	char *plain[32];
	size_t n = 0;
	for (size_t i = 0; argv[i]; i++) {
		if (n + 1 == sizeof(plain) / sizeof(plain[0])) {
			errno = E2BIG;
			return -1;
		}
		if (strcmp(argv[i], "--gzip") != 0)
			plain[n++] = argv[i];
	}
	plain[n] = NULL;
	return real(file, plain);
}
