/*
 * Part 15 of the shim (criu-shim.c): the pages of a dump written into their image on a thread
 * of their own, while CRIU goes on (GROVE_ASYNC_PAGE_WRITES=1, tracked dumps, with part 7).
 *
 * Part 7 moves each pipe of pages CRIU filled into its pages image with one splice: a copy of
 * every page into the page cache, about 1.1 us a page here (3.7 ms for 5 % of a 256 MiB heap),
 * on CRIU's thread, while the sandbox is frozen and the other core mostly waits. The pipe holds
 * references to the process's own pages, which the sandbox cannot change while it is frozen
 * (until this CRIU has exited: Grove thaws it then). So the pages are moved, still by reference,
 * into a pipe of the writer's (no copy), CRIU's file position is moved past them, and a thread
 * splices them into the image at their offset while CRIU dumps on; CRIU's exit waits until
 * every page is written. CRIU itself does write into those pages: compel pokes a syscall
 * instruction over the start of a process's lowest executable mapping (the vDSO, where that
 * comes first) for every call it makes the process run, and puts the bytes back after it. Such
 * a page, taken before and written while poked, reached the image with compel's code in it
 * (found by the crash test: no restore of that snapshot passed the vDSO check). So every poke
 * waits until the pages taken before it are written (page_writer_drain, from the shim's
 * ptrace). A failed write makes CRIU exit with 1, so the dump fails and Grove dumps again in
 * full. The image is byte for byte the one part 7 writes.
 * A process forked from CRIU (its tar children, part 12) writes its own pages, if any. The
 * kernel lets only a single-threaded process enter another mount or user namespace, so before
 * CRIU does, the writer finishes what it has and stops (page_writer_stop, from the shim's
 * setns and unshare); the next pages start it again.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "page-writer.h"

struct job {
	int pipe, image;
	loff_t at;
	size_t len;
	struct job *next;
};

static struct job *head, *tail;
static unsigned pending;
static int failed;
/* The process that started a writer (a process forked from it writes its own pages). */
static pid_t owner;
static int running, stopping;
static pthread_t thread;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t queued = PTHREAD_COND_INITIALIZER;
static pthread_cond_t drained = PTHREAD_COND_INITIALIZER;

/* The shim wraps splice and close; the writer's own calls go straight to the kernel. */
static long sys_splice(int in, loff_t *off_in, int out, loff_t *off_out, size_t len)
{
	long r;
	do
		r = syscall(SYS_splice, in, off_in, out, off_out, len, 0);
	while (r < 0 && errno == EINTR);
	return r;
}

static void sys_close(int fd)
{
	syscall(SYS_close, fd);
}

static void *writer(void *unused)
{
	(void)unused;
	for (;;) {
		pthread_mutex_lock(&lock);
		while (!head && !stopping)
			pthread_cond_wait(&queued, &lock);
		if (!head) {
			pthread_mutex_unlock(&lock);
			return NULL;
		}
		struct job *job = head;
		head = job->next;
		if (!head)
			tail = NULL;
		pthread_mutex_unlock(&lock);
		size_t done = 0;
		while (done < job->len) {
			loff_t at = job->at + (loff_t)done;
			long r = sys_splice(job->pipe, NULL, job->image, &at, job->len - done);
			if (r <= 0)
				break;
			done += (size_t)r;
		}
		sys_close(job->pipe);
		sys_close(job->image);
		pthread_mutex_lock(&lock);
		if (done < job->len)
			failed = 1;
		if (--pending == 0)
			pthread_cond_broadcast(&drained);
		pthread_mutex_unlock(&lock);
		free(job);
	}
	return NULL;
}

/* The writer, started on first use (again after a stop); 0 if it runs. */
static int writer_running(void)
{
	if (owner && owner != getpid())
		return -1;
	if (running)
		return 0;
	stopping = 0;
	if (pthread_create(&thread, NULL, writer, NULL) != 0)
		return -1;
	owner = getpid();
	running = 1;
	return 0;
}

int page_writer_stop(void)
{
	if (!running || owner != getpid())
		return 0;
	pthread_mutex_lock(&lock);
	while (pending)
		pthread_cond_wait(&drained, &lock);
	stopping = 1;
	pthread_cond_signal(&queued);
	pthread_mutex_unlock(&lock);
	pthread_join(thread, NULL);
	running = 0;
	return 1;
}

void page_writer_drain(void)
{
	if (!running || owner != getpid())
		return;
	pthread_mutex_lock(&lock);
	while (pending)
		pthread_cond_wait(&drained, &lock);
	pthread_mutex_unlock(&lock);
}

ssize_t page_writer_take(int pipe, int image, size_t len)
{
	struct job *job = malloc(sizeof(*job));
	if (!job)
		return -1;
	int p[2] = {-1, -1};
	off_t at = lseek(image, 0, SEEK_CUR);
	if (at < 0 || writer_running() != 0 || pipe2(p, O_CLOEXEC) != 0)
		goto none;
	if (fcntl(p[1], F_SETPIPE_SZ, (int)len) < (int)len)
		goto none;
	job->image = fcntl(image, F_DUPFD_CLOEXEC, 0);
	if (job->image < 0)
		goto none;
	size_t moved = 0;
	while (moved < len) {
		long r = sys_splice(pipe, NULL, p[1], NULL, len - moved);
		if (r <= 0)
			break;
		moved += (size_t)r;
	}
	sys_close(p[1]);
	if (moved == 0 || lseek(image, at + (off_t)moved, SEEK_SET) < 0) {
		/* Nothing is on its way: what was moved goes where it belongs now. */
		size_t done = 0;
		while (done < moved) {
			loff_t to = at + (loff_t)done;
			long r = sys_splice(p[0], NULL, image, &to, moved - done);
			if (r <= 0)
				break;
			done += (size_t)r;
		}
		sys_close(p[0]);
		sys_close(job->image);
		free(job);
		if (moved == 0)
			return -1;
		if (done < moved) {
			/* Pages out of CRIU's pipe that reached no image: the dump must fail. */
			pthread_mutex_lock(&lock);
			failed = 1;
			pthread_mutex_unlock(&lock);
		}
		lseek(image, at + (off_t)moved, SEEK_SET);
		return (ssize_t)moved;
	}
	*job = (struct job){.pipe = p[0], .image = job->image, .at = at, .len = moved};
	pthread_mutex_lock(&lock);
	if (tail)
		tail->next = job;
	else
		head = job;
	tail = job;
	pending++;
	pthread_cond_signal(&queued);
	pthread_mutex_unlock(&lock);
	return (ssize_t)moved;
none:
	if (p[0] >= 0) {
		sys_close(p[0]);
		sys_close(p[1]);
	}
	free(job);
	return -1;
}

/* CRIU's exit (the sandbox is still frozen): every page written first. */
__attribute__((destructor)) static void page_writer_finish(void)
{
	if (!owner || owner != getpid())
		return;
	page_writer_stop();
	if (failed) {
		dprintf(2, "grove shim: writing pages into their image failed; the dump fails\n");
		_exit(1);
	}
}
